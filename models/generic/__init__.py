"""The transformers path: any decoder-only transformers model whose attention goes through
transformers' ``AttentionInterface``, exported with every attention layer on the paged ops
(``attnexport::reshape_and_cache`` + ``attnexport::paged_attention``) and everything else the
model's own code::

    from attnexport.models.generic import load_transformers_checkpoint
    model = load_transformers_checkpoint("/path/to/checkpoint")  # a DecoderModel
    sample = model.export_sample(block_size=16)
    program = sample.export(model)

* :mod:`.attention` — the attention function registered with transformers and the step it reads.
* :mod:`.model` — :class:`TransformersDecoder`, the decoder forward over a transformers model.
* :mod:`.support` — what the config rules out before loading.
* :mod:`.parity` — the probe against transformers' own attention that every load runs.
* :mod:`.loader` — loading a checkpoint or a config.

``docs/models.md`` ("The transformers path") lists the families tried, passed and refused.
"""

from attnexport.models.generic.loader import (
    load_transformers_checkpoint,
    read_hf_config,
    transformers_model_from_config,
)
from attnexport.models.generic.model import TransformersDecoder

__all__ = [
    "TransformersDecoder",
    "load_transformers_checkpoint",
    "read_hf_config",
    "transformers_model_from_config",
]
