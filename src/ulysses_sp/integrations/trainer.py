"""Ulysses SP inside the Transformers ``Trainer``: two lines in a training script.

    trainer = UlyssesTrainer(model=model, args=training_args, train_dataset=ds, data_collator=coll,
                             sp_config=UlyssesSPConfig(sp_size=2))
    trainer.train()

What changes against ``transformers.Trainer`` (everything else, callbacks, logging, checkpoints,
``report_to``, is the Trainer's own)::

    data     accelerate shards batches over the WORLD; here over data-parallel replicas only
             (dp_size, dp_rank): the P ranks of an SP group read the SAME global batch, so
             steps / epochs / total batch size / num_input_tokens_seen count a group once.
    batch    global (B, S) --UlyssesSP.shard--> (B, s) tokens + global positions + shift labels
    loss     loss_r = (CE sum of my tokens) / N * W     N = valid tokens of the whole optimizer
             step (all grad-accum micro-batches, all ranks), W = world (DDP / FSDP2 / ZeRO
             average over it) => averaged gradient = one-process gradient of the global token mean;
             the Trainer's own GA division and world scaling are off (``loss_is_scaled_for_ga``).
    logging  the Trainer logs mean_r(sum of micro-step loss_r) = the global token mean.
    eval     per batch: token mean over the SP group (one-process value); losses gathered over
             DP replicas only. Logits are sharded, so ``compute_metrics`` is refused under SP.

``per_device_train_batch_size`` is the batch of one SP group (one DP replica).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
from transformers import Trainer

from ulysses_sp.comm.mesh import SPMesh
from ulysses_sp.config import UlyssesSPConfig
from ulysses_sp.data import ShardedBatch
from ulysses_sp.integrations.setup_checks import ensure_process_group, refuse_accelerate_parallelism
from ulysses_sp.integrations.trainer_internals import count_input_tokens, prepare_inputs, train_batch_size
from ulysses_sp.integrations.transformers import UlyssesSP
from ulysses_sp.loss import global_num_items, reported_loss
from ulysses_sp.memory import ActivationOffload

_GLOBAL_KEY = "ulysses_global_batch"  # the global batch's token tensors, for token counting only


class UlyssesTrainerMixin:
    """Mix in before a ``transformers.Trainer`` subclass to train with Ulysses SP.

    Args:
        sp_config: the SP configuration (default ``UlyssesSPConfig()``: sp_size 1). All other
            arguments go to the Trainer unchanged.

    Attributes (after ``__init__``):
        sp_config: the configuration; sp_mesh: the ``dp x sp`` :class:`SPMesh`;
        ulysses: the registered :class:`UlyssesSP` of the model;
        activation_offload: the :class:`ActivationOffload` (its ``stats``) when
        ``sp_config.offload_activations``, else None.

    Raises:
        ValueError: before training, for settings SP cannot honour (sp_size not dividing the world,
            a model that cannot be made sequence-parallel, ``compute_metrics`` / label smoothing /
            ``compute_loss_func`` / ``n_gpu > 1`` / ``dispatch_batches`` under SP, a collator that
            drops packed ``position_ids``, ``offload_activations`` without gradient checkpointing).
    """

    loss_is_scaled_for_ga = True  # our loss is already divided by the whole step's token count

    def __init__(self, *args: Any, sp_config: UlyssesSPConfig | None = None, **kwargs: Any) -> None:
        self.sp_config = sp_config if sp_config is not None else UlyssesSPConfig()
        if not isinstance(self.sp_config, UlyssesSPConfig):
            raise ValueError(f"sp_config must be a UlyssesSPConfig, got {type(self.sp_config).__name__}.")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        refuse_accelerate_parallelism(getattr(training_args, "parallelism_config", None),
                                      "TrainingArguments.parallelism_config", "the TrainingArguments",
                                      "UlyssesTrainer(..., sp_config=UlyssesSPConfig(sp_size=...))")
        super().__init__(*args, **kwargs)
        self._check_trainer_settings()
        ensure_process_group(self.args.world_size, "gloo", "TrainingArguments.world_size is")
        self.sp_config.validate(self.args.world_size)
        self.sp_mesh: SPMesh = self.sp_config.build_mesh(timeout_s=self.args.ddp_timeout)
        # Trainer (re)enables gradient checkpointing in train(), replacing the layers' checkpoint
        # functions: the offload wrappers are (re)installed at each training forward instead of
        # once at UlyssesSP.register(), so UlyssesSP gets the config without offload.
        self.ulysses: UlyssesSP = UlyssesSP(
            self.model, self.sp_mesh, self.sp_config.replace(offload_activations=False)
        ).register()
        self.activation_offload = ActivationOffload(self.model) if self.sp_config.offload_activations else None
        self.model_accepts_loss_kwargs = True
        packed_rows = any(_dataset_has_column(self.train_dataset, c) for c in ("position_ids", "seq_lengths"))
        padding_free = getattr(self, "padding_free", False) or getattr(self.args, "padding_free", False)
        self._expects_position_ids = packed_rows or bool(padding_free)

    def _check_trainer_settings(self) -> None:
        args = self.args
        if args.n_gpu > 1:
            raise ValueError(
                f"Ulysses SP needs one process per device, but this process drives {args.n_gpu} GPUs "
                "(torch.nn.DataParallel); launch with torchrun / accelerate launch instead."
            )
        if self.model_init is not None:
            raise ValueError("model_init (hyperparameter search) is not supported by UlyssesTrainer; pass model=...")
        if args.train_sampling_strategy == "batch_rebalance" and self.sp_config.sp_size > 1:
            raise ValueError(
                "train_sampling_strategy='batch_rebalance' assigns batches per world rank, so the ranks of an SP group "
                "would read different data; use 'random', 'sequential' or 'group_by_length'."
            )
        if args.label_smoothing_factor != 0:
            raise ValueError("label_smoothing_factor is not supported with UlyssesTrainer; set it to 0.")
        if self.compute_loss_func is not None:
            raise ValueError(
                "compute_loss_func is not used by UlyssesTrainer (the loss is computed on sequence shards); "
                "remove it, or subclass and override compute_loss with UlyssesSP.forward_loss."
            )
        if self.sp_config.offload_activations and not args.gradient_checkpointing:
            raise ValueError(
                "offload_activations moves the inputs of checkpointed layers to CPU, so it needs "
                "TrainingArguments(activation_checkpointing=True) (or its older name gradient_checkpointing=True); "
                "enable it or set offload_activations=False."
            )
        if self.compute_metrics is not None and self.sp_config.sp_size > 1:
            raise ValueError(
                "compute_metrics needs full-sequence logits, but under sequence parallelism each rank holds only "
                "its shard; evaluate() reports eval_loss. Remove compute_metrics or use sp_size=1."
            )

    # data -----------------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        return self._shard_by_dp(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The eval loader split over DP replicas; it keeps the last partial batch even with
        ``dataloader_drop_last`` (meant for training): every held-out row counts in eval_loss."""
        drop_last = self.args.dataloader_drop_last
        self.args.dataloader_drop_last = False
        try:
            return self._shard_by_dp(super().get_eval_dataloader(eval_dataset))
        finally:
            self.args.dataloader_drop_last = drop_last

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return self._shard_by_dp(super().get_test_dataloader(test_dataset))

    def _shard_by_dp(self, loader: Any) -> Any:
        """Make accelerate's world sharding a DP-replica sharding (ranks of an SP group: same batches)."""
        if self.sp_mesh.sp_size == 1:
            return loader
        if isinstance(loader, DataLoaderDispatcher):
            raise ValueError(
                "accelerate's dispatch_batches splits each batch over all processes, which would give the ranks of an "
                "SP group different data; pass TrainingArguments(accelerator_config={'dispatch_batches': False})."
            )
        for shard in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)):
            if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
                shard.num_processes, shard.process_index = self.sp_mesh.dp_size, self.sp_mesh.dp_rank
            if isinstance(shard, BatchSamplerShard) and self.sp_mesh.dp_size == 1:
                # one replica: nothing to even out. accelerate's even_batches would complete the last
                # batch with rows from the start, counting them twice (eval_loss != one process)
                shard.even_batches = False
        return loader

    def _shard(self, batch: Mapping[str, Any]) -> ShardedBatch:
        """Check a collated global ``(B, S)`` batch and cut this rank's ``(B, s)`` shard (``UlyssesSP.shard``)."""
        shard = self.ulysses.shard(batch, packed=self._expects_position_ids)
        global_tokens = {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch}
        shard[_GLOBAL_KEY] = global_tokens  # type: ignore[literal-required]
        return shard

    @staticmethod
    def global_batch(inputs: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
        """The GLOBAL ``input_ids`` / ``attention_mask`` of the batch a shard came from (token counting)."""
        return inputs.get(_GLOBAL_KEY, inputs)

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[ShardedBatch], torch.Tensor | None]:
        """The step's micro-batches as shards, and N: valid tokens of the whole step, all ranks."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        shards = [self._shard(prepare_inputs(self, batch)) for batch in batches]
        if not shards:
            return [], None
        # every SP rank counts only its shard, so the sum over the world counts each token once
        return shards, global_num_items([s["shift_labels"] for s in shards])

    def _track_num_input_tokens(self, inputs: Mapping[str, Any]) -> None:
        """Count the GLOBAL batch once per SP group (the Trainer gathers over all ranks)."""
        before = self.state.num_input_tokens_seen
        count_input_tokens(super(), self.global_batch(inputs))
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.sp_mesh.sp_size

    def get_total_train_batch_size(self, args: Any) -> int:
        """Sequences per optimizer step: per-replica batch x grad accumulation x DP replicas."""
        return train_batch_size(self) * args.gradient_accumulation_steps * self.sp_mesh.dp_size

    # loss -------------------------------------------------------------------------------
    def compute_loss(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """This rank's share ``CE_sum / N * world`` of the step's global token-mean loss.

        ``inputs`` is a shard from :meth:`get_batch_samples`; ``num_items_in_batch`` is N (counted
        here over the world for this batch alone if not given).
        """
        if "ulysses_mask" not in inputs:
            raise ValueError(
                "UlyssesTrainer.compute_loss expects a shard from UlyssesTrainer._shard(batch), got a raw batch."
            )
        if num_items_in_batch is None:
            num_items_in_batch = global_num_items(inputs["shift_labels"])
        if self.activation_offload is not None and model.training:
            self.activation_offload.register()  # cheap when already installed
        loss = self._sp_loss(model, inputs, num_items_in_batch, dist.get_world_size())
        return (loss, None) if return_outputs else loss

    def _sp_loss(
        self, model: torch.nn.Module, shard: Mapping[str, Any], num_items: torch.Tensor | int, grad_average_world: int
    ) -> torch.Tensor:
        """``CE_sum(my tokens) / num_items * grad_average_world`` (subclasses add metrics here)."""
        return self.ulysses.forward_loss(model, shard, num_items, grad_average_world=grad_average_world)

    def prediction_step(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, None, None]:
        """The batch's token-mean loss (same on all SP ranks); logits stay sharded and are not returned."""
        shard = self._shard(prepare_inputs(self, inputs))
        group = self.sp_mesh.sp_group
        with torch.no_grad(), self.compute_loss_context_manager():
            num_items = global_num_items(shard["shift_labels"], group=group)
            loss = reported_loss(self._sp_loss(model, shard, num_items, 1), 1, group=group)
        return loss, None, None

    @property
    def gather_function(self) -> Any:
        """Eval gathering over DP replicas only (the SP ranks of a replica hold the same values)."""
        return self._gather_over_dp if hasattr(self, "sp_mesh") and self.sp_mesh.sp_size > 1 else self._hf_gather

    @gather_function.setter
    def gather_function(self, value: Any) -> None:
        self._hf_gather = value

    def _gather_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = self.accelerator.gather(tensor.contiguous())
        per_rank = gathered.reshape(self.sp_mesh.dp_size, self.sp_mesh.sp_size, *tensor.shape)
        data = per_rank[:, 0].reshape(-1, *tensor.shape[1:])
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # accelerate's even_batches padding
            data = data[: state.remainder]
        return data

    # saving ------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save with the model's own attention kernel and ``use_cache`` in its config."""
        self.ulysses.unregister()
        try:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        finally:
            self.ulysses.register()


class UlyssesTrainer(UlyssesTrainerMixin, Trainer):
    """``transformers.Trainer`` with Ulysses sequence parallelism (see :class:`UlyssesTrainerMixin`)."""


def _dataset_has_column(dataset: Any, name: str) -> bool:
    """Whether the rows of a (map-style) dataset carry ``name``."""
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        return name in columns
    try:
        row = dataset[0]
    except Exception:  # iterable or empty datasets: nothing to check up front
        return False
    return isinstance(row, Mapping) and name in row
