"""GLM-5.3: GLM-5 with IndexShare and a 1M-token context.

IndexShare runs the lightning indexer on layers 0, 1, 2 and every 4th layer after
(6, 10, ..., 74: 21 of 78); the other layers reuse the top-k of the nearest earlier full
layer. Everything else is `configs/glm5.py`, loaded from beside this file.

A model preset, not a job (`glmjax-train` stops on it, naming the job configs): the SAO
job configs/glm53_sao.py loads it, and the memory plan reads it:

    glmjax-aot --config configs/glm53_sao.py --topology v5p:8x8x4 --json /tmp/aot.json
    python -m glmjax.plan --config configs/glm53.py --devices 256 --device-memory-gb 95 --search
"""

import os

from glmjax.presets import load_config


def get_config(arg=None):
    """`arg` (after `configs/glm53.py:`) is unused."""
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "glm5.py"), arg=arg)
    config.model.index_topk_freq = 4
    config.model.index_skip_topk_offset = 3
    config.model.rope_parameters.rope_theta = 8e6
    config.model.max_position_embeddings = 1048576
    return config
