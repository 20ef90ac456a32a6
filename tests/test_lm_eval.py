"""lm-evaluation-harness against ``/v1/completions``: a loglikelihood task (multiple choice)
through its ``local-completions`` backend, which sends token ids with ``echo`` and
``logprobs`` and reads the prompt's token logprobs back.

The task file and its data are written by the test; the tokenizer is the model store's folder
(no hub: ``HF_HUB_OFFLINE=1``). lm-eval runs in a subprocess of its own: from this venv when
``lm-eval[api]`` is installed there (the ``eval`` extra), else from the folder
``$EDGECLOUD_LM_EVAL_PATH`` names (a ``pip install --target`` of it, put after this venv's
packages); the test is skipped without either. Each logged loglikelihood must equal the sum of
a torch reference forward's log-softmax over the continuation's tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from cloud_engine.model.loader import load_model
from tests.nodes import serve_node, tiny_cloud_engine
from tests.test_logprobs import ref_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = [
    {"question": "The sky on a clear day is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " of fun"], "answer": 0},
]

TASK = """task: edgecloud_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _lm_eval_command() -> list[str] | None:
    extra = os.environ.get("EDGECLOUD_LM_EVAL_PATH")
    if importlib.util.find_spec("lm_eval") is not None:
        return [sys.executable, "-m", "lm_eval"]
    if extra and (Path(extra) / "lm_eval").is_dir():
        boot = (
            f"import sys, runpy; sys.path.append({extra!r}); sys.argv[0] = 'lm_eval'; "
            "runpy.run_module('lm_eval', run_name='__main__')"
        )
        return [sys.executable, "-c", boot]
    return None


@pytest.fixture(scope="module")
def cloud_node(tiny_model_path: Path) -> Iterator[str]:
    served = serve_node(tiny_cloud_engine(tiny_model_path), tiny_model_path, "cloud-lmeval")
    try:
        yield served.url
    finally:
        served.stop()


def test_lm_eval_loglikelihood_task_through_local_completions(
    cloud_node: str, tiny_model_path: Path, default_model_path: Path, tmp_path: Path
) -> None:
    cmd = _lm_eval_command()
    if cmd is None:
        pytest.skip("lm-eval is not installed (pip install 'edgecloud[eval]')")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "edgecloud_tiny_mc.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    model_args = ",".join(
        [
            f"model={tiny_model_path.name}",
            f"base_url={cloud_node}/v1/completions",
            f"tokenizer={default_model_path}",
            "tokenizer_backend=huggingface",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    args = [
        "--model", "local-completions", "--model_args", model_args,
        "--tasks", "edgecloud_tiny_mc", "--include_path", str(tasks),
        "--output_path", str(out), "--log_samples", "--batch_size", "1",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "x"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    proc = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    samples = [json.loads(line) for f in out.rglob("samples_*.jsonl") for line in f.open()]
    assert len(samples) == len(DOCS)

    model = load_model(tiny_model_path).eval()
    tok = Tokenizer.from_file(str(default_model_path / "tokenizer.json"))
    for s in samples:
        doc = s["doc"]
        for choice, resp in zip(doc["choices"], s["resps"], strict=True):
            ll = float(resp[0][0])
            # lm-eval's pairing: context + " ", the choice after it, trailing spaces moved over
            context, cont = doc["question"] + " ", choice
            spaces = len(context) - len(context.rstrip())
            context, cont = context[:-spaces], context[-spaces:] + cont
            ctx = tok.encode(context, add_special_tokens=False).ids
            whole = tok.encode(context + cont, add_special_tokens=False).ids
            ref = ref_logprobs(model, whole)
            want = sum(float(ref[p - 1, whole[p]]) for p in range(len(ctx), len(whole)))
            assert ll == pytest.approx(want, abs=1e-3), (doc, choice)
