"""Ulysses SP in a custom Hugging Face Accelerate training loop.

    accelerator = Accelerator(gradient_accumulation_steps=2)
    sp = UlyssesAccelerate(accelerator, UlyssesSPConfig(sp_size=2))      # validates, builds the mesh
    model, optimizer, loader = sp.prepare(model, optimizer, loader)     # 1. UlyssesSP 2. DDP 3. dp split
    for batch in loader:                       # this rank's shard of a global micro-batch
        with accelerator.accumulate(model):
            loss = sp.loss_for(model, batch)   # shard loss / global token count of the step
            accelerator.backward(loss)         # DDP average = one process on the global batch
            optimizer.step(); optimizer.zero_grad()
        log(sp.reported_loss(loss))            # this micro-batch's part of the step's mean loss

The data path of one optimizer step (A = gradient_accumulation_steps, W = world = dp * sp)::

    dataset --DistributedSampler(num_replicas=dp, rank=dp_rank)--> A global micro-batches per replica
       (the sp ranks of one group read the SAME batches; steps per epoch count replicas, not ranks)
    --shard_batch--> (B, s) shards     --one all-reduce--> N = valid tokens of all A micro-batches
    loss_r = CE sum of my tokens / N * W * A     (Accelerate's backward divides by A, DDP by W)

Accelerate's own sequence parallelism (``ParallelismConfig(sp_size>1)``, DeepSpeed ALST) must not
run as well: :class:`UlyssesAccelerate` refuses an Accelerator configured for it.
:func:`config_from_accelerate` reads Accelerate's names (``sp_size``, ``sp_backend``,
``sp_seq_length_is_variable``, ``sp_attn_implementation``; plain, ``parallelism_config_``-prefixed
or ``PARALLELISM_CONFIG_SP_*`` environment variables) into a :class:`UlyssesSPConfig`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ulysses_sp.config import UlyssesSPConfig
from ulysses_sp.integrations.setup_checks import ensure_process_group, refuse_accelerate_parallelism
from ulysses_sp.integrations.transformers import UlyssesSP
from ulysses_sp.loss import global_num_items, reported_loss

_SP_KEYS = ("sp_size", "sp_backend", "sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation",
            "sp_allow_recurrent_layers", "sp_disable_in_eval")
_OTHER_PARALLEL = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "cp_comm_strategy")
_DDP_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU")


def _as_bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


def _accelerate_values(source: Any) -> dict[str, Any]:
    """Accelerate's parallelism names from ``source`` as a plain dict (prefixes removed)."""
    if source is None:
        prefix = "PARALLELISM_CONFIG_"
        return {k[len(prefix):].lower(): v for k, v in os.environ.items() if k.startswith(prefix)}
    if isinstance(source, Accelerator):
        source = source.parallelism_config
        if source is None:
            return {}
    if not isinstance(source, Mapping):  # a ParallelismConfig: fields, and the sp_handler's fields
        handler = getattr(source, "sp_handler", None)
        values = {k: getattr(source, k) for k in _SP_KEYS + _OTHER_PARALLEL if hasattr(source, k)}
        for k in ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation", "sp_allow_recurrent_layers"):
            if handler is not None and getattr(handler, k, None) is not None:
                values[k] = getattr(handler, k)
        return values
    if isinstance(source.get("parallelism_config"), Mapping):  # a whole accelerate config file
        source = source["parallelism_config"]
    return {k.removeprefix("parallelism_config_"): v for k, v in source.items()}


def config_from_accelerate(source: Any = None, **ours: Any) -> UlyssesSPConfig:
    """A :class:`UlyssesSPConfig` from Accelerate's parallelism names.

    Args:
        source: a mapping (``{"sp_size": 2, ...}``, the ``parallelism_config:`` section of an
            ``accelerate launch --config_file`` YAML with ``parallelism_config_sp_size`` keys, or the
            whole file), a ``ParallelismConfig``, an ``Accelerator``, or None for the
            ``PARALLELISM_CONFIG_SP_*`` environment variables ``accelerate launch`` sets.
        **ours: options Accelerate has no name for (``tiled_mlp_tokens``, ``tiled_loss_tokens``).

    Raises:
        ValueError: for values ulysses-sp cannot honour, naming what to write instead:
            ``sp_backend="deepspeed"`` with ``sp_size > 1`` (Accelerate's DeepSpeed-ALST; here
            ulysses-sp IS the backend: ``sp_backend: ulysses``; with ``sp_size=1`` it is ignored),
            ``tp_size`` / ``cp_size`` / ``dp_shard_size`` (FSDP) > 1, ``sp_allow_recurrent_layers``,
            ``sp_disable_in_eval``, an ``sp_attn_implementation`` we cannot run (hub kernels).
    """
    values = _accelerate_values(source)
    unknown = sorted(set(values) - set(_SP_KEYS) - set(_OTHER_PARALLEL))
    if unknown:
        known = sorted(_SP_KEYS + _OTHER_PARALLEL)
        raise ValueError(f"unknown Accelerate parallelism option(s) {unknown}; known: {known}.")
    for key in ("tp_size", "cp_size", "dp_shard_size"):
        if values.get(key) is not None and int(values[key]) > 1:
            raise ValueError(
                f"{key}={values[key]} is not supported with ulysses-sp in an Accelerate loop (DDP replicas x "
                f"Ulysses SP only); set {key}: 1 and give all non-SP ranks to data parallelism."
            )
    backend = str(values.get("sp_backend") or "ulysses").lower()
    sp_size = values.get("sp_size", 1)
    sp_size = int(sp_size) if isinstance(sp_size, str) and sp_size.strip().isdigit() else sp_size
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}.")
    if backend == "deepspeed" and sp_size > 1:
        raise ValueError(
            "sp_backend='deepspeed' selects Accelerate's own DeepSpeed-ALST sequence parallelism; with "
            "ulysses-sp, ulysses-sp is the backend: write sp_backend: ulysses (or leave it out) in the mapping "
            "you pass to config_from_accelerate, keep Accelerate's own parallelism_config sp_size at 1, and "
            f"pass the result to UlyssesAccelerate (e.g. UlyssesSPConfig(sp_size={sp_size}))."
        )
    if _as_bool(values.get("sp_allow_recurrent_layers", False)):
        raise ValueError("sp_allow_recurrent_layers=True is not supported: ulysses-sp refuses recurrent layers; "
                         "remove the option.")
    if "sp_disable_in_eval" in values and _as_bool(values["sp_disable_in_eval"]):
        raise ValueError(
            "sp_disable_in_eval=True is not supported: ulysses-sp keeps SP on in eval; remove the option and feed "
            "eval batches through sp.prepare(...) loaders or sp.shard(batch)."
        )
    attn = values.get("sp_attn_implementation")
    variable = values.get("sp_seq_length_is_variable")
    return UlyssesSPConfig(
        sp_size=sp_size, sp_backend="ulysses" if sp_size == 1 else backend,
        sp_attn_implementation=None if attn in (None, "None", "") else str(attn),
        sp_seq_length_is_variable=True if variable is None else _as_bool(variable), **ours,
    )


class _SkipBatches:
    """A batch sampler that leaves out its first ``skip`` batches (indices only, nothing loaded)."""

    def __init__(self, batch_sampler: BatchSampler, skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


class UlyssesAccelerateLoader:
    """Global batches split over DATA-PARALLEL replicas only, yielded as this rank's shards.

    Each item is :meth:`UlyssesSP.shard` of one global micro-batch ``(B, S)`` plus
    ``num_items_in_batch``: valid tokens of the whole optimizer step (its ``accumulation_steps``
    micro-batches on all replicas, one all-reduce per step). ``len()`` = micro-batches per epoch
    per replica. Resumable: ``state_dict()`` = (epoch, micro-batches done in it); a restored loader
    continues where the saved one stopped, with the same shuffling.
    """

    def __init__(self, dataloader: DataLoader, adapter: UlyssesAccelerate, seed: int = 0) -> None:
        if isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_size is None:
            raise ValueError(
                "sp.prepare needs a DataLoader over a map-style dataset with batch_size set, so that it can "
                "split it over data-parallel replicas only; build DataLoader(dataset, batch_size=..., ...)."
            )
        if type(dataloader.sampler) not in (SequentialSampler, RandomSampler):
            raise ValueError(
                f"sp.prepare rebuilds the loader's sampler to split data over data-parallel replicas only, so a "
                f"{type(dataloader.sampler).__name__} would be dropped; pass DataLoader(dataset, shuffle=True/False) "
                "or iterate your own loader split with DistributedSampler(**dp_sampler_kwargs(sp.mesh)) "
                "(ulysses_sp.data) and call sp.shard(batch) (its token count is one batch's: "
                "gradient_accumulation_steps=1 only)."
            )
        self.adapter, self.dataloader = adapter, dataloader
        mesh = adapter.mesh
        self.sampler = DistributedSampler(dataloader.dataset, num_replicas=mesh.dp_size, rank=mesh.dp_rank,
                                          shuffle=isinstance(dataloader.sampler, RandomSampler), seed=seed)
        self.batch_sampler = BatchSampler(self.sampler, dataloader.batch_size, dataloader.drop_last)
        self.accumulation_steps = adapter.accumulation_steps
        if len(self.batch_sampler) % self.accumulation_steps:
            raise ValueError(
                f"{len(self.batch_sampler)} batches per epoch per replica is not a multiple of "
                f"gradient_accumulation_steps={self.accumulation_steps}: an optimizer step would span two epochs; "
                "change the dataset size, batch_size or gradient_accumulation_steps (or drop_last=True)."
            )
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["position"] % self.accumulation_steps:
            raise ValueError("the checkpoint was saved inside an optimizer step; save after optimizer.step().")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.sampler.set_epoch(self.epoch)
        dl = self.dataloader
        loader = DataLoader(dl.dataset, batch_sampler=_SkipBatches(self.batch_sampler, self.position),
                            collate_fn=dl.collate_fn, num_workers=dl.num_workers, pin_memory=dl.pin_memory)
        batches = iter(loader)
        first = True
        while group := list(itertools.islice(batches, self.accumulation_steps)):
            shards = [self.adapter.shard_batch(batch, check_same=first) for batch in group]
            first = False
            num_items = global_num_items([s["shift_labels"] for s in shards])
            for shard in shards:
                shard["num_items_in_batch"] = num_items
                self.position += 1
                yield shard
        self.epoch, self.position = self.epoch + 1, 0


class UlyssesAccelerate:
    """Ulysses SP for a model trained by a custom Accelerate loop (flow in the module docstring).

    Args:
        accelerator: a DDP or single-process ``Accelerator`` (``distributed_type`` NO / MULTI_CPU /
            MULTI_GPU ...), without Accelerate's own ``sp_size`` / ``tp_size`` / ``cp_size``.
        config: the SP settings; default: :func:`config_from_accelerate` of the environment.

    Raises ``ValueError`` before any collective when ``sp_size`` does not divide the number of
    processes or the Accelerator is configured for something this integration does not run.
    """

    def __init__(self, accelerator: Accelerator, config: UlyssesSPConfig | None = None) -> None:
        self.accelerator = accelerator
        self.config = config if config is not None else config_from_accelerate()
        if accelerator.num_processes == 1 and self.config.sp_size > 1:
            raise ValueError(
                f"sp_size={self.config.sp_size} needs {self.config.sp_size} processes, but the Accelerator runs 1. "
                "Launch several: `accelerate launch --config_file examples/accelerate_config.yaml ...` (a config with "
                f"num_processes: {self.config.sp_size} and a multi-process distributed_type), `accelerate launch "
                f"--multi_gpu --num_processes {self.config.sp_size} ...` or `torchrun --nproc-per-node "
                f"{self.config.sp_size} ...`; `--num_processes` alone, without a multi-process config, "
                "starts one process."
            )
        self.config.validate(accelerator.num_processes)
        self._check_accelerator()
        ensure_process_group(accelerator.num_processes, "nccl" if accelerator.device.type == "cuda" else "gloo",
                             "the Accelerator")
        handler = getattr(accelerator, "init_handler", None)  # InitProcessGroupKwargs(timeout=...), if given
        timeout = getattr(handler, "timeout", None)
        self.mesh = self.config.build_mesh("cuda" if accelerator.device.type == "cuda" else "cpu",
                                           timeout_s=timeout.total_seconds() if timeout is not None else None)
        self.accumulation_steps = accelerator.gradient_accumulation_steps
        self.grad_average_world = dist.get_world_size() * self.accumulation_steps
        self.ulysses: UlyssesSP | None = None  # the registered UlyssesSP (as UlyssesTrainer.ulysses)

    def _check_accelerator(self) -> None:
        kind = self.accelerator.distributed_type
        if str(kind).split(".")[-1] not in _DDP_TYPES:
            raise ValueError(
                f"UlyssesAccelerate runs under DDP or one process, got distributed_type={kind}; use an accelerate "
                "config with distributed_type MULTI_GPU (or MULTI_CPU) / NO. For ZeRO or FSDP2 use the plain "
                "PyTorch loop (README) - DeepSpeed with sp_size would also start Accelerate's own ALST SP."
            )
        refuse_accelerate_parallelism(self.accelerator.parallelism_config, "the Accelerator's ParallelismConfig",
                                      "the accelerate config / Accelerator(...)",
                                      "UlyssesAccelerate(accelerator, UlyssesSPConfig(sp_size=...))")
        if self.config.offload_activations:
            raise ValueError("offload_activations is not supported by UlyssesAccelerate; set it to False.")

    def prepare(self, model: torch.nn.Module, *objects: Any, seed: int = 0) -> Any:
        """Register :class:`UlyssesSP` on ``model``, then ``accelerator.prepare`` it and ``objects``.

        DataLoaders among ``objects`` are not handed to Accelerate (it would split them over all
        ranks): each becomes a :class:`UlyssesAccelerateLoader` (dp-only split, shuffled with
        ``seed`` when the loader shuffled) registered for ``accelerator.save_state``. Loaders are
        checked first, so a ``ValueError`` leaves the model untouched. Returns the objects in the
        order given (the model alone if nothing else), like ``accelerator.prepare``.
        """
        is_loader = [isinstance(o, DataLoader) for o in objects]
        loaders = [UlyssesAccelerateLoader(o, self, seed=seed) for o in objects if isinstance(o, DataLoader)]
        self.ulysses = UlyssesSP(model, self.mesh, self.config).register()
        others = [o for o, dl in zip(objects, is_loader) if not dl]
        prepared = self.accelerator.prepare(model, *others)
        rest, wrapped = iter(prepared if others else [prepared]), iter(loaders)
        out = [next(rest)]
        for dl in is_loader:
            out.append(next(wrapped) if dl else next(rest))
        if loaders:
            self.accelerator.register_for_checkpointing(*loaders)
        return out[0] if len(out) == 1 else tuple(out)

    def shard(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's shard of a global batch fed by hand (e.g. eval), ready for :meth:`loss_for`.

        Checks with one all-gather that the SP group holds the same batch (``validate_same_batch``:
        a batch whose length differs across SP ranks raises a ``ValueError`` on every rank instead of
        hanging in the all-to-all) and adds ``num_items_in_batch``, the batch's global valid tokens.
        """
        shard = self.shard_batch(batch, check_same=True)
        shard["num_items_in_batch"] = global_num_items(shard["shift_labels"])
        return shard

    def shard_batch(self, batch: Mapping[str, Any], check_same: bool = True) -> dict[str, Any]:
        """``UlyssesSP.shard`` of ``batch`` moved to the accelerator's device (no token count added)."""
        if self.ulysses is None:
            raise ValueError("call sp.prepare(model, ...) before sharding batches.")
        device = self.accelerator.device
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return dict(self.ulysses.shard(batch, check_same=check_same))

    def loss_for(self, model: torch.nn.Module, shard: Mapping[str, Any]) -> torch.Tensor:
        """Forward the prepared ``model`` on a shard and return this rank's loss for
        ``accelerator.backward`` (tiled lm_head + CE when ``config.tiled_loss_tokens`` is set)."""
        if self.ulysses is None or "num_items_in_batch" not in shard:
            raise ValueError("loss_for needs a shard from a loader returned by sp.prepare(...) or sp.shard(batch).")
        return self.ulysses.forward_loss(model, shard, shard["num_items_in_batch"],
                                    grad_average_world=self.grad_average_world)

    def reported_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part of the optimizer step's global token-mean loss (same on all ranks);
        the values of one step's micro-batches add up to the step's loss."""
        return reported_loss(loss.detach(), self.grad_average_world)
