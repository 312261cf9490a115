"""KV caches that serve a model's attention (see ``model.attention_api``)."""
from .reference import CacheStats, DiffKVReferenceCache, attend_kept

__all__ = ["CacheStats", "DiffKVReferenceCache", "attend_kept"]
