"""The SSD tier's storage backends, behind one `StorageFile` protocol.

posix (default): pread/pwrite with O_DIRECT on aligned buffers, run on the caller's
    thread pool. buffered: the same without O_DIRECT, where the file system refuses it
    (tmpfs), chosen with a `StorageFallbackWarning`. kvikio: GPUDirect Storage through
    kvikio, chosen only when CUDA and its driver are present.
All take a `bandwidth_bytes_per_s` cap (a token bucket shared by reads and writes).
"""

from snake.io.base import ALIGN, StorageFallbackWarning, StorageFile, align_up
from snake.io.open import open_storage

__all__ = ["ALIGN", "StorageFile", "StorageFallbackWarning", "align_up", "open_storage"]
