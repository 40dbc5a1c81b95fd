"""``scripts/model_families.py``: the per-family status table of docs/models.md and how it is produced."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "model_families.py"
STATUSES = {"exact", "refused", "not checked", "DEFECT"}


@pytest.fixture(scope="module")
def mf():
    spec = importlib.util.spec_from_file_location("model_families", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_is_exact_and_bloom_refused_through_worker(mf):
    """Bug caught: a script whose statuses do not come from the check: Llama must run both scenarios in
    the worker process (SP ranks spawned, loss and gradients compared) and match; Bloom (ALiBi, no
    AttentionInterface) must be refused up front with check_model_support's reason, never run."""
    llama, bloom = mf.check_families(["llama", "bloom"], time_limit_s=120, progress=False)
    assert llama["status"] == "exact", llama
    assert llama["model_class"] == "LlamaForCausalLM" and llama["kernel"] == "sdpa"
    assert set(llama["scenarios"]) == set(mf.SCENARIOS)
    # fp32 SP vs one process differ by summation order only (~1e-6); the engine's tolerance is 1e-4
    assert all(s["ok"] and s["grad_rel"] < 1e-4 for s in llama["scenarios"].values())
    assert bloom["status"] == "refused" and not bloom["scenarios"]
    assert "does not dispatch attention through transformers' AttentionInterface" in bloom["reason"]


def test_family_over_time_limit_is_a_defect_and_does_not_hang(mf):
    """Bug caught: one slow or hanging family blocking the whole run: past the time limit its worker
    (and the SP ranks under it) is killed and the family is reported as a DEFECT."""
    (entry,) = mf.check_families(["llama"], time_limit_s=0.01, progress=False)
    assert entry["status"] == "DEFECT" and "no result within the time limit" in entry["reason"]


def test_docs_table_is_generated_from_the_record(mf):
    """Bug caught: a hand-edited or stale table: docs/models.md between the markers must be exactly what
    render_table makes of the JSON record, the record must cover every causal-LM family of the
    installed transformers (rerun the script after upgrading), and every non-exact row has a reason."""
    record = json.loads(mf.RECORD.read_text())
    assert mf.docs_table() == mf.render_table(record)
    families = [e["family"] for e in record["families"]]
    assert families == mf.all_families()
    assert record["transformers"] == __import__("transformers").__version__
    for entry in record["families"]:
        assert entry["status"] in STATUSES, entry
        assert entry["status"] == "exact" or entry["reason"], entry
