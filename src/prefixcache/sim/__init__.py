"""prefixcache.sim"""
