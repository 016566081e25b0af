"""Device math: paged-attention kernels, their references, and the KV-cache layout."""
from pallas_kernels.metadata import NULL_BLOCK_ID, PAD_SLOT_ID, AttentionMetadata

