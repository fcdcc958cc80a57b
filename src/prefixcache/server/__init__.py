"""prefixcache.server"""
