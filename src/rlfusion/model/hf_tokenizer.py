"""Hugging Face tokenizers (a local `tokenizer.json`) and chat templates behind the `Tokenizer`
contract.

Owns reading a tokenizer folder (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`),
the special ids the engine needs, chat-template rendering and the JSON form kept in rlfusion
checkpoints. Needs the `tokenizers` and `jinja2` packages (the `hf` extra), not `transformers`.

Special ids: the project's convention (`evaluate.encode_prompt`) puts `bos_id` before every
prompt. Tokenizers without a BOS token (the Qwen families) use their pad token, else eos, as the
document start: for Qwen that is `<|endoftext|>`, the separator its pretraining data put between
documents. `encode` adds no
specials, and a rendered chat template drops a leading BOS string, so BOS is never doubled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

EXTRA = "hf"


def _special(value) -> str | None:
    """`tokenizer_config.json` writes special tokens as strings or as `{"content": ...}` dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the ids and methods of the project's `Tokenizer` protocol."""

    def __init__(self, tokenizer_json: str, special: dict[str, str | None],
                 chat_template: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("HF tokenizers need the tokenizers package: "
                              f"pip install 'rlfusion[{EXTRA}]'") from None
        self._json, self.special, self.chat_template = tokenizer_json, dict(special), chat_template
        self._tok = Tokenizer.from_str(tokenizer_json)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = self._id(special.get("eos_token"), "eos_token")
        if eos is None:
            raise ValueError("HF tokenizer has no eos_token (set it in tokenizer_config.json); "
                             "generation needs a stop token")
        self.eos_id = eos
        pad = self._id(special.get("pad_token"), "pad_token")
        self.pad_id = eos if pad is None else pad
        bos = self._id(special.get("bos_token"), "bos_token")
        self.bos_id = self.pad_id if bos is None else bos  # see the module docstring

    def _id(self, token: str | None, key: str) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer_config.json {key}={token!r} is not in the vocabulary "
                             f"of tokenizer.json")
        return i

    @classmethod
    def from_dir(cls, path: str | Path, fallback_eos_id: int | None = None) -> HFTokenizer:
        """Read `tokenizer.json` (required) and the special tokens / chat template beside it.
        `fallback_eos_id` (e.g. from the model's `config.json`) names eos when the tokenizer
        config does not."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast HF tokenizers are "
                                    f"supported; save one with tokenizer.save_pretrained)")
        config: dict = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        special = {k: _special(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        tokenizer_json = (path / "tokenizer.json").read_text()
        if special["eos_token"] is None and fallback_eos_id is not None:
            from tokenizers import Tokenizer

            special["eos_token"] = Tokenizer.from_str(tokenizer_json).id_to_token(fallback_eos_id)
        return cls(tokenizer_json, special, template)

    # ---- the Tokenizer protocol ----

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    # ---- chat ----

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (`[{"role": ..., "content": ...}]`), rendered by the
        tokenizer's Jinja chat template the way transformers renders it."""
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat_template (tokenizer_config.json or "
                             "chat_template.jinja); set data.chat_template=false")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self.special.items() if v is not None})
        bos = self.special.get("bos_token")
        return text[len(bos):] if bos and text.startswith(bos) else text

    # ---- checkpoint form ----

    def to_dict(self) -> dict:
        return {"kind": "hf", "tokenizer_json": self._json, "special": self.special,
                "chat_template": self.chat_template}

    @classmethod
    def from_dict(cls, d: dict) -> HFTokenizer:
        if d.get("kind") != "hf" or not isinstance(d.get("tokenizer_json"), str):
            raise ValueError(f"tokenizer dict is not an HF tokenizer (kind={d.get('kind')!r}, "
                             f"needs 'tokenizer_json')")
        return cls(d["tokenizer_json"], d.get("special", {}), d.get("chat_template"))

    def save(self, path: str | Path) -> None:
        """Write `tokenizer.json` and a `tokenizer_config.json` that transformers also reads."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "tokenizer.json").write_text(self._json)
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  **{k: v for k, v in self.special.items() if v is not None}}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    def __repr__(self) -> str:
        return (f"HFTokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, "
                f"pad={self.pad_id}, chat_template={'yes' if self.chat_template else 'no'})")


def tokenizer_from_dict(d: dict):
    """The tokenizer of a checkpoint's JSON form: `CharTokenizer` (`kind="char"`) or HF."""
    from rlfusion.model.tokenizer import CharTokenizer

    kinds = {"char": CharTokenizer.from_dict, "hf": HFTokenizer.from_dict}
    if d.get("kind") not in kinds:
        raise ValueError(f"tokenizer kind={d.get('kind')!r} is unknown; allowed: {', '.join(kinds)}")
    return kinds[d["kind"]](d)
