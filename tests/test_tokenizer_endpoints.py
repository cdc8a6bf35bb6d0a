"""#48: the tokenizer where tools look for it — vLLM's ``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` at the
root and under ``/v1`` — and embeddings' ``dimensions`` refused with the values that can be honoured. A real `exod
serve`, a real runner, the tiny model.

lm-eval (0.4.9 and later, through 0.4.13) is not installed here, so its remote tokenizer is spoken to as its source
does (EleutherAI/lm-evaluation-harness, ``lm_eval/utils.py``: ``check_remote_tokenizer_support`` and
``RemoteTokenizer``; ``lm_eval/models/openai_completions.py``, ``LocalCompletionsAPI``, calls the first with the
``base_url`` given to ``local-completions``): a `requests` session with ``Content-Type: application/json``, the
server's root taken from ``base_url`` by removing ``/v1/completions`` and ``/v1/chat/completions``, then
``GET /tokenizer_info`` (detection needs a JSON object with ``eos_token``), ``POST /tokenize`` with ``{"prompt",
"add_special_tokens": false}`` (needs ``tokens``, a list), ``POST /detokenize`` with ``{"tokens"}`` (needs ``prompt``,
text), ``eos_token_id`` as the first token of ``eos_token`` encoded, and the chat template rendered by jinja2 with
``messages`` and ``add_generation_prompt``. No request names a model.
"""

from __future__ import annotations

import httpx
import jinja2
import openai
import pytest
import requests

from daemon_harness import placing, ready_daemon, runner_pids
from exod.host.models import resolve_model

MODEL = "exod/tiny-qwen2"
OTHER = "exod/tiny-slow"  # in the same cache, placed by the one test that needs two models served
CONFIG = placing(MODEL)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("tokenizer"), CONFIG, {MODEL: 0, OTHER: 1}) as (url, hf):
        yield url, hf
    assert runner_pids() == []


@pytest.fixture(scope="module")
def daemon(served):
    return served[0]


@pytest.fixture(scope="module")
def hf_tokenizer(served):
    """The model's tokenizer as transformers loads it: what vLLM's answers are made of."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(MODEL, hf_home=served[1], offline=True)))


class LmEvalRemoteTokenizer:
    """What lm-eval's remote tokenizer sends and reads (see the module's docstring), nothing more."""

    def __init__(self, base_url: str) -> None:
        self.root = base_url.replace("/v1/completions", "").replace("/v1/chat/completions", "").rstrip("/")
        self.session = requests.Session()
        self.session.headers.update({"Content-Type": "application/json"})

    def call(self, method: str, path: str, **kwargs) -> requests.Response:
        response = self.session.request(method, f"{self.root}{path}", timeout=60, **kwargs)
        response.raise_for_status()
        return response

    def supported(self) -> bool:
        """``check_remote_tokenizer_support``: what decides that ``local-completions`` uses this tokenizer."""
        info = self.call("GET", "/tokenizer_info").json()
        if not isinstance(info, dict) or "eos_token" not in info:
            return False
        tokens = self.call("POST", "/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
        return isinstance(tokens.get("tokens"), list)

    @property
    def info(self) -> dict:
        return self.call("GET", "/tokenizer_info").json()

    def encode(self, text: str) -> list[int]:
        tokens = self.call("POST", "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert isinstance(tokens, list)
        return tokens

    def decode(self, tokens: list[int]) -> str:
        prompt = self.call("POST", "/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert isinstance(prompt, str)
        return prompt

    @property
    def eos_token_id(self) -> int | None:
        eos = self.info.get("eos_token")
        return None if eos is None else self.encode(eos)[0]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        template = jinja2.Environment().from_string(self.info["chat_template"])
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("suffix", ["/v1/completions", "/v1/chat/completions", "/v1"])
def test_lm_evals_remote_tokenizer_is_detected_and_agrees_with_the_models_own(daemon, hf_tokenizer, suffix):
    """lm-eval takes ``base_url`` as given to it: the completions URL (root endpoints), or ``…/v1`` (``/v1/…``)."""
    remote = LmEvalRemoteTokenizer(f"{daemon}{suffix}")
    assert remote.supported()
    assert remote.eos_token_id == hf_tokenizer.eos_token_id
    text = "The quick brown fox jumps over the lazy dog."
    tokens = remote.encode(text)
    assert tokens == hf_tokenizer.encode(text, add_special_tokens=False)
    assert remote.decode(tokens) == text
    chat = [{"role": "user", "content": "Tell me about state machines."}]
    assert remote.apply_chat_template(chat) == hf_tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )


def test_tokenizer_info_says_what_vllm_does(daemon, hf_tokenizer):
    """vLLM answers with the tokenizer's ``init_kwargs`` (tokenizer_config.json, special tokens as text, file
    paths left out), its class and its chat template."""
    info = httpx.get(f"{daemon}/tokenizer_info").json()
    assert info == httpx.get(f"{daemon}/v1/tokenizer_info", params={"model": MODEL}).json()
    for key in ("bos_token", "eos_token", "pad_token", "model_max_length", "clean_up_tokenization_spaces"):
        expected = hf_tokenizer.init_kwargs[key]
        assert info[key] == getattr(expected, "content", expected), key  # an AddedToken: its text, as vLLM says it
    assert info["chat_template"] == hf_tokenizer.chat_template
    assert info["tokenizer_class"] and info["name_or_path"] == MODEL
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & info.keys()
    unknown = httpx.get(f"{daemon}/tokenizer_info", params={"model": "exod/not-here"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_and_detokenize_round_trip_at_the_root_and_under_v1(daemon, hf_tokenizer, prefix):
    text = "State machines, explicit lifecycles."
    named = httpx.post(f"{daemon}{prefix}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert named["tokens"] == hf_tokenizer.encode(text) and named["count"] == len(named["tokens"])
    assert named["max_model_len"] == 2048
    unnamed = httpx.post(f"{daemon}{prefix}/tokenize", json={"prompt": text}).json()  # the one model served
    assert unnamed == named
    back = httpx.post(f"{daemon}{prefix}/detokenize", json={"model": MODEL, "tokens": named["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    chat = [{"role": "user", "content": "hi"}]
    templated = httpx.post(f"{daemon}{prefix}/tokenize", json={"messages": chat}).json()["tokens"]
    assert templated == hf_tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_dimensions_that_cannot_be_honoured_are_a_400_naming_the_one_that_can(daemon):
    client = openai.OpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0, timeout=60)
    width = len(client.embeddings.create(model=MODEL, input="state machines").data[0].embedding)
    same = client.embeddings.create(model=MODEL, input="state machines", dimensions=width)
    assert len(same.data[0].embedding) == width
    for wrong in (width // 2, width + 1):
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=MODEL, input="state machines", dimensions=wrong)
        error = refused.value.body
        assert error["param"] == "dimensions"
        assert f"{wrong} cannot be honoured" in error["message"]
        assert f"the only value dimensions can take is {width}" in error["message"]


def test_with_several_models_served_the_model_must_be_named(daemon):
    placed = httpx.post(f"{daemon}/instances", json={"model": OTHER, "ranks": 1})
    assert placed.status_code == 201, placed.text
    try:
        for unnamed in (
            httpx.get(f"{daemon}/tokenizer_info"),
            httpx.post(f"{daemon}/v1/tokenize", json={"prompt": "hi"}),
            httpx.post(f"{daemon}/detokenize", json={"tokens": [1]}),
        ):
            assert unnamed.status_code == 400, unnamed.text
            error = unnamed.json()["error"]
            assert error["param"] == "model" and MODEL in error["message"] and OTHER in error["message"]
        other = httpx.get(f"{daemon}/tokenizer_info", params={"model": OTHER}).json()
        assert other["name_or_path"] == OTHER and other["eos_token"]
    finally:
        httpx.delete(f"{daemon}/instances/{placed.json()['instance_id']}")
