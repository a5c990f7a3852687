"""Per-architecture patching of Hugging Face Qwen modules onto the fused kernels."""

from unsloth_lite.models import qwen2, qwen3, qwen3_5  # noqa: F401  (each registers its table)
from unsloth_lite.models.host_embeddings import HostEmbedding, offload_embeddings_to_host
from unsloth_lite.models.loading import add_lora, load_model
from unsloth_lite.models.patching import ARCHITECTURES, patch_model
from unsloth_lite.models.quantized_embeddings import NF4Embedding, quantize_embeddings_nf4

__all__ = [
    "ARCHITECTURES", "HostEmbedding", "NF4Embedding", "add_lora", "load_model", "offload_embeddings_to_host",
    "patch_model", "quantize_embeddings_nf4",
]
