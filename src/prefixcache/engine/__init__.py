"""prefixcache.engine"""
