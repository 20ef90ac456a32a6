"""A model's recommended sampling (generation_config.json's temperature / top_p / top_k) is
what a request that omits those fields gets, as in vLLM; a request's own value wins. The
catalog writes its model card's recommendation into the store folder, also into a folder
pulled before it named one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx

from cloud_engine.model.catalog import CATALOG, write_sampling
from routing.model_store import DEFAULT_MODEL
from routing.prompt import sampling_defaults
from tests.nodes import serve_node, tiny_cloud_engine


def test_sampling_defaults_read_numbers_only() -> None:
    cfg = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "do_sample": True, "eos_token_id": 2}
    assert sampling_defaults(cfg) == {"temperature": 0.2, "top_p": 0.9, "top_k": 40.0}
    assert sampling_defaults({"temperature": "hot", "top_p": True}) == {}


def test_catalog_sampling_reaches_an_older_store_folder(tmp_path: Path) -> None:
    entry = CATALOG[DEFAULT_MODEL]
    assert dict(entry.sampling) == {"temperature": 0.2, "top_p": 0.9}  # SmolLM2's model card
    gc = tmp_path / "generation_config.json"
    gc.write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    assert write_sampling(tmp_path, entry)
    assert json.loads(gc.read_text()) == {
        "eos_token_id": [2, 0],
        "bos_token_id": 1,
        "temperature": 0.2,
        "top_p": 0.9,
    }
    assert not write_sampling(tmp_path, entry)  # already there: the file is left alone


def _tokens(url: str, model: str, seed: int, **sampling: float) -> str:
    body = {
        "model": model,
        "prompt": "The weather today",
        "max_tokens": 8,
        "ignore_eos": True,
        "seed": seed,
        **sampling,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_request_without_temperature_gets_the_models_default(
    tiny_model_path: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    model = tmp_path / "greedy-by-default"
    shutil.copytree(tiny_model_path, model)
    gc = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gc, "temperature": 0.0}))
    node = serve_node(tiny_cloud_engine(model), model, "cloud-defaults")
    try:
        greedy = _tokens(node.url, model.name, 1, temperature=0.0)
        # omitted: the folder's temperature 0 (greedy whatever the seed)
        assert _tokens(node.url, model.name, 1) == greedy
        assert _tokens(node.url, model.name, 2) == greedy
        # given: the request's own value (a tiny random model sampled at 1.5 leaves greedy)
        hot = {_tokens(node.url, model.name, s, temperature=1.5) for s in (1, 2, 3)}
        assert greedy not in hot and len(hot) > 1
    finally:
        node.stop()
