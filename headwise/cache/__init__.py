from headwise.cache.manager import CacheConfigError, KVCacheManager

__all__ = ["KVCacheManager", "CacheConfigError"]
