"""sao_hf_agent: SAO post-training of your own Hugging Face checkpoint as an agent, over
several turns in sandboxed shells.

    glmjax-train --config configs/sao_hf_agent.py:/tmp/my-model --workdir /tmp/my-agent
    glmjax-train --config configs/sao_hf_agent.py:/tmp/my-model --workdir /tmp/my-agent \\
        --config.task.harbor_dir=tests/harbor_tasks

configs/sao_hf.py's job on `lookup` tasks (envs/families/lookup.py), or a directory of
Harbor tasks: the checkpoint's chat template lists the shell as two tools, `bash(command)`
and `submit(answer)`; the model calls them in the template's own tool-call format (GLM's
<tool_call> with <arg_key>/<arg_value>, or JSON: `env.action_format="auto"`), and each
command's output comes back as the template's tool result. Every episode's row is the
tokens the engine produced and the observations' tokens as the template appends them.
"""

import os

from glmjax.presets import load_config
from rl.config import EnvConfig, TaskConfig, section


def get_config(arg=None):
    here = os.path.dirname(os.path.abspath(__file__))
    config = load_config(os.path.join(here, "sao_hf.py"), arg=arg)
    config.task = section(TaskConfig, family="lookup", difficulty=1, train_tasks=64, eval_tasks=16, max_len=320,
                          max_new_tokens=48)
    config.env = section(EnvConfig, workers=2, max_turns=3, turn_tokens=48, memory_mb=512, disk_mb=256)
    return config
