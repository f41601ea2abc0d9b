"""Checkpoints of the RL loop: everything a killed run needs to continue exactly.

One orbax `CheckpointManager` (asynchronous saves, the newest `keep` retained) holds, per
step: the policy and critic parameters (and router biases), the optimizers' states (actor,
critic, and the MTP layer's when it trains), the learner's step and skip counters, the
task stream's position (grain iterator state), the admission counters, the weight
version, the base model's pass rate and whatever else the trainer passes (its running
totals for summary.json). Arrays go through `StandardSave`;
the small loop state through `JsonSave`.

With several processes every process saves and restores (orbax writes each array's
shards from the processes that hold them, the metadata from process 0); the task
stream's position and the admission counters are each process's own, so the metadata
holds one of each per process, and a run resumes with the number of processes that wrote
it.

Restore reads the newest step that reads in full (its metadata, then every array) and
only then loads it into the live objects, so a failed read changes nothing. With several
processes the choice is made together: process 0 lists the steps, every process reads
its own shards of a step without any barrier, and the step is taken only if it read on
every process (`distributed.failures`); a read that fails on one host makes all of them
skip that step, so no host waits for another that went its own way. A step that
does not read (a truncated array file, metadata that is not JSON or lacks a field) is
skipped with one warning naming it and why; once an older step has read, each skipped
step is moved aside to `<step>.corrupt` in the same directory, kept for inspection, and
its step number is free again for the resumed run's save. When no step reads, nothing is
moved and `UnreadableCheckpoints` lists every step's reason: a run whose model config
changed since it was checkpointed fails on every step, and must not start over in place.
"""

from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from glmjax import distributed, storage

log = logging.getLogger(__name__)

# What restore loads into the live objects; a checkpoint without one of them does not read.
_REQUIRED_META = ("step", "version", "learner_steps", "skipped", "stream", "admission")


class UnreadableCheckpoints(RuntimeError):
    """Every checkpoint in the directory fails to read (the message lists each step's reason)."""


def _modules(policy, critic, learner) -> dict:
    out = {"policy": policy, "actor_opt": learner.actor_opt}
    if critic is not None:
        out.update(critic=critic, critic_opt=learner.critic_opt)
    if getattr(learner, "mtp_opt", None) is not None:  # a learner that trains the MTP layer (rl.mtp_lr)
        out["mtp_opt"] = learner.mtp_opt
    return out


def _reason(err: BaseException, limit: int = 400) -> str:
    """`err` and the innermost error of its chain, on one line: orbax wraps TensorStore's
    precise message ("OUT_OF_RANGE: Error reading ...") in a generic one that dumps the
    whole array spec, so the layers between are left out."""
    inner = err
    while inner.__cause__ is not None or inner.__context__ is not None:
        inner = inner.__cause__ or inner.__context__
    text = " ".join(str(inner).split())
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    detail = f"{type(inner).__name__}: {text}" if text else type(inner).__name__
    return str(err) if inner is err else f"{err}: {detail}"


def _own(meta: dict, key: str, step: int):
    """This process's entry of a per-process metadata field (a checkpoint written before
    the fields were per process holds one value)."""
    value = meta[key]
    if not isinstance(value, list):
        return value
    if len(value) != jax.process_count():
        raise UnreadableCheckpoints(f"checkpoint step {step} was written by {len(value)} process(es) and this run has "
                                    f"{jax.process_count()}: resume it with --config.distributed.num_processes="
                                    f"{len(value)}")
    return value[jax.process_index()]


class LoopCheckpointer:
    def __init__(self, directory: str, keep: int = 2):
        self.directory = str(storage.path(directory))  # a local directory, or gs://... (orbax writes there itself)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        # reads are this process's alone: orbax's restore ends in a barrier of every
        # process, which a host whose read failed never reaches
        alone = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                                   active_processes={jax.process_index()},
                                                   barrier_sync_key_prefix=f"read{jax.process_index()}")
        self.reader = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            create=False, multiprocessing_options=alone))

    def save(self, step: int, *, policy, critic, learner, stream, admission, version: int, **extra) -> None:
        """Starts an asynchronous save of `step`; `extra` (JSON values) lands in the metadata."""
        arrays = {k: nnx.state(m).to_pure_dict() for k, m in _modules(policy, critic, learner).items()}
        meta = {"step": step, "version": version, "learner_steps": learner.steps, "skipped": learner.skipped,
                "stream": distributed.gather_objects(stream.get_state()),
                "admission": distributed.gather_objects(admission.state_dict()), **extra}
        self.manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                         meta=ocp.args.JsonSave(meta)))

    def restore(self, *, policy, critic, learner, stream, admission) -> dict | None:
        """Loads the newest checkpoint that reads into the given objects and returns its
        metadata; None when there is no checkpoint. Steps that do not read are skipped and
        set aside (module docstring); UnreadableCheckpoints when none reads."""
        modules = _modules(policy, critic, learner)
        abstract = {k: jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(m).to_pure_dict())
                    for k, m in modules.items()}
        failed = []  # (step, reason), newest first
        for step in distributed.broadcast_object(sorted(self.manager.all_steps(), reverse=True)):
            try:
                meta, arrays = self._read(step, abstract)
                reason = None
            except Exception as err:  # orbax raises TensorStore read failures as a plain Exception
                reason = _reason(err)
            failures = distributed.failures(reason)
            if not failures:
                break
            failed.append((step, distributed.describe_failures(failures)))
        else:
            if failed:
                raise UnreadableCheckpoints(f"no checkpoint in {self.directory} reads: " + "; ".join(
                    f"step {s}: {why}" for s, why in failed))
            return None
        for bad, why in failed:
            where = os.path.join(self.directory, str(bad))
            moved = storage.set_aside(where) if distributed.is_main() else where + ".corrupt"
            log.warning("checkpoint step %d does not read (%s): resuming from step %d instead; step %d is moved "
                        "to %s", bad, why, step, bad, moved)
        if failed:
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("glmjax.checkpoint.set_aside")
            self.manager.reload()
            self.reader.reload()
        stream_state, admission_state = _own(meta, "stream", step), _own(meta, "admission", step)
        for k, m in modules.items():
            state = nnx.state(m)
            nnx.replace_by_pure_dict(state, arrays[k])
            nnx.update(m, state)
        learner.steps, learner.skipped = meta["learner_steps"], meta["skipped"]
        stream.set_state(stream_state)
        admission.load_state_dict(admission_state)
        return meta

    def _read(self, step: int, abstract: dict) -> tuple[dict, dict]:
        """Step `step`'s metadata and arrays, read in full; raises if any part does not read."""
        try:
            meta = self.reader.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as err:
            raise ValueError(f"{step}/meta/metadata") from err
        missing = [k for k in _REQUIRED_META if k not in (meta if isinstance(meta, dict) else {})]
        if missing:
            raise ValueError(f"{step}/meta/metadata lacks {missing}")
        try:
            arrays = self.reader.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract)))
        except Exception as err:
            raise ValueError(f"{step}/arrays") from err
        return meta, arrays["arrays"]

    def wait(self) -> None:
        self.manager.wait_until_finished()
