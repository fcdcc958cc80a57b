"""prefixcache.attention"""
