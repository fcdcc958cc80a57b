"""prefixcache.tools"""
