"""prefixcache.model"""
