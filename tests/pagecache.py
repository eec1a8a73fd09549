"""How much of a file the page cache holds (for tests that reads leave it alone): the
package's own `mincore` count."""

from offload.memory.page_cache import cached_bytes

__all__ = ["cached_bytes"]
