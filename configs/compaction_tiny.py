"""compaction_tiny: SAO with compaction on answers that outgrow the context window.

    glmjax-train --config configs/compaction_tiny.py --workdir /tmp/glmjax-compaction
    glmjax-train --config configs/compaction_tiny.py --workdir /tmp/glmjax-no-compaction \
        --config.rl.compaction.enabled=False

The `counting` family ("count 13 to 25 by 2=" -> "13 15 17 ... 25\\n") at difficulties 1-5
has answers of 5 to 13 terms, 35 to 59 tokens with the prompt, against a window of 40
(max_len 41: the engine keeps one entry): only the shortest fit. With compaction a rollout that fills the window writes the last
term as its summary and continues from [prompt, summary] (rl/compaction.py); without it
the long ones are cut off and score 0. The base model is trained on the same layout
(demonstrations replayed through the compaction state machine); with compaction off it
is trained on whole answers, so both arms see every task.
"""

import os

from glmjax.presets import load_config


def get_config(arg=None):
    del arg
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sao_tiny.py"))
    # difficulty None: 1..5 mixed; the family has ~780 distinct tasks (~96 held out)
    config.task.update(family="counting", difficulty=None, max_len=41, max_new_tokens=48, train_tasks=600,
                       eval_tasks=90)
    config.base.update(seq_len=64, steps=500, demonstrations=600)
    # Attention over the whole window: the base's supervised training leaves the lightning
    # indexer untrained, and a random top-16 of 40 keys cannot copy the prompt's numbers.
    config.model.index_topk = 64
    config.rl.update(steps=40, batch_size=32, slots=32)
    config.rl.compaction.update(enabled=True, summary_tokens=4, max_segments=4)
    return config
