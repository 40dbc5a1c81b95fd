"""Benchmarks: our Ulysses SP against DeepSpeed's, ring attention and one process (``ulysses-sp bench``).

Main entry points:
    run_job(Job(system, sp_size, seq_len, ...))   one configuration in fresh processes -> JSON record
    CommCounter                                    counts collectives / bytes sent by wrapping torch.distributed
    attention_comm(system, P, B, S, N, K, H, b)    the communication model (formula) per attention layer
    markdown(records), plots(records, dir)         the report

Only this subpackage imports DeepSpeed (and only when the ``deepspeed`` system runs).
"""

from ulysses_sp.bench.counting import CommCounter
from ulysses_sp.bench.formulas import AttentionComm, attention_comm
from ulysses_sp.bench.report import check_records, markdown, plots
from ulysses_sp.bench.runner import Job, run_job
from ulysses_sp.bench.systems import SYSTEMS, ModelSpec

__all__ = ["SYSTEMS", "AttentionComm", "CommCounter", "Job", "ModelSpec", "attention_comm", "check_records",
           "markdown", "plots", "run_job"]
