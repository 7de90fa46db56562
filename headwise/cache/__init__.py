from headwise.cache.layout import HeadLayout, HeadSpec, LayoutError, resolve_layout
from headwise.cache.manager import CacheConfigError, KVCacheManager

__all__ = ["HeadLayout", "HeadSpec", "LayoutError", "resolve_layout", "KVCacheManager", "CacheConfigError"]
