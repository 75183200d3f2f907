"""Hugging Face tokenizers (a local `tokenizer.json`) and chat templates behind the `Tokenizer`
contract.

Owns reading a tokenizer folder (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`),
the special ids the engine needs, chat-template rendering with the assistant's tokens marked
(`model/chat_template.py` compiles the template when the tokenizer is made, so a template that
does not compile is named then, with its file and line) and the JSON form kept in rlfusion
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

from rlfusion.model.chat_template import ChatTemplate, ChatText, token_mask
from rlfusion.model.files import first_line, read_json_file, read_text_file

EXTRA = "hf"


def _special(value) -> str | None:
    """`tokenizer_config.json` writes special tokens as strings or as `{"content": ...}` dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the ids and methods of the project's `Tokenizer` protocol."""

    def __init__(self, tokenizer_json: str, special: dict[str, str | None],
                 chat_template: str | None = None, where: str = "tokenizer.json",
                 config_where: str = "tokenizer_config.json", template_where: str | None = None) -> None:
        """`where` names the file `tokenizer_json` came from, `config_where` the one that set
        `special` and `template_where` (default: `config_where`) the one that held the chat
        template; errors name them."""
        self._json, self.special, self.chat_template = tokenizer_json, dict(special), chat_template
        self._tok = _parse_tokenizer(tokenizer_json, where)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        template_where = template_where or config_where
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"{template_where}: chat_template must be a string, got "
                             f"{type(chat_template).__name__}")
        self._template = ChatTemplate(chat_template, template_where) if chat_template else None
        ids = {key: self._id(special.get(key), key, where, config_where)
               for key in ("eos_token", "pad_token", "bos_token")}
        if ids["eos_token"] is None:
            raise ValueError(f"{config_where}: the tokenizer has no eos_token (set one); "
                             f"generation needs a stop token")
        self.eos_id = ids["eos_token"]
        self.pad_id = self.eos_id if ids["pad_token"] is None else ids["pad_token"]
        # No BOS token: pad (else eos) starts a document, see the module docstring.
        self.bos_id = self.pad_id if ids["bos_token"] is None else ids["bos_token"]

    def _id(self, token: str | None, key: str, where: str, config_where: str) -> int | None:
        if token is None:
            return None
        if not isinstance(token, str):
            raise ValueError(f"{config_where}: {key}={token!r} must be a token string")
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{config_where}: {key}={token!r} is not in the vocabulary of {where}")
        return i

    @classmethod
    def from_dir(cls, path: str | Path, fallback_eos_id: int | None = None) -> HFTokenizer:
        """Read `tokenizer.json` (required) and the special tokens / chat template beside it.
        `fallback_eos_id` (e.g. from the model's `config.json`) names eos when the tokenizer
        config does not."""

        path = Path(path)
        where, config_where = path / "tokenizer.json", path / "tokenizer_config.json"
        if not where.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast HF tokenizers are "
                                    f"supported; save one with tokenizer.save_pretrained)")
        config = read_json_file(config_where) if config_where.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_where}: not a tokenizer config (a JSON object), "
                             f"got a JSON {type(config).__name__}")
        special = {k: _special(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        template, template_where = config.get("chat_template"), config_where
        if (path / "chat_template.jinja").is_file():
            template_where = path / "chat_template.jinja"
            template = read_text_file(template_where)
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        tokenizer_json = read_text_file(where)
        if special["eos_token"] is None and isinstance(fallback_eos_id, int) and fallback_eos_id >= 0:
            vocab = _parse_tokenizer(tokenizer_json, str(where))
            special["eos_token"] = vocab.id_to_token(fallback_eos_id)
        return cls(tokenizer_json, special, template, str(where), str(config_where), str(template_where))

    # ---- the Tokenizer protocol ----

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    # ---- chat ----

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (`[{"role": ..., "content": ...}]`), rendered by the
        tokenizer's Jinja chat template the way transformers renders it, less a leading BOS."""
        return self.render_chat(messages, add_generation_prompt).text

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> ChatText:
        """`messages` rendered as transformers' `apply_chat_template(tokenize=False)` renders
        them (less a leading BOS string: the rollout puts `bos_id` first), with the character
        spans of the template's `{% generation %}` bodies, the assistant's text. A template
        error is one `ValueError` line naming the template's file and line."""
        if self._template is None:
            raise ValueError("the tokenizer has no chat_template (tokenizer_config.json or "
                             "chat_template.jinja); set data.chat_template=false")
        specials = {k: v for k, v in self.special.items() if v is not None}
        chat = self._template.render(messages, add_generation_prompt, **specials)
        return chat.strip_prefix(self.special.get("bos_token"))

    def chat_tokens(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """`(ids, assistant_mask)` of `render_chat`'s text: 1 for every token that overlaps a
        `{% generation %}` span, as transformers' `return_assistant_tokens_mask` marks them (all
        0 for a template without the tag); what a multi-turn loss mask is made from."""
        chat = self.render_chat(messages, add_generation_prompt)
        encoding = self._tok.encode(chat.text, add_special_tokens=False)
        return encoding.ids, token_mask(encoding.offsets, chat.assistant_spans)

    # ---- checkpoint form ----

    def to_dict(self) -> dict:
        return {"kind": "hf", "tokenizer_json": self._json, "special": self.special,
                "chat_template": self.chat_template}

    @classmethod
    def from_dict(cls, d: dict, where: str = "tokenizer dict") -> HFTokenizer:
        """The tokenizer of `to_dict`; `where` names the file the dict was read from."""
        if d.get("kind") != "hf" or not isinstance(d.get("tokenizer_json"), str):
            raise ValueError(f"{where}: tokenizer is not an HF tokenizer (kind={d.get('kind')!r}, "
                             f"needs a string 'tokenizer_json')")
        special = d.get("special", {})
        if not isinstance(special, dict):
            raise ValueError(f"{where}: tokenizer 'special' must be a JSON object of token strings")
        return cls(d["tokenizer_json"], special, d.get("chat_template"), where, where)

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


def _parse_tokenizer(tokenizer_json: str, where: str):
    """A `tokenizers.Tokenizer`; `ValueError` naming `where` if the text is not one."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("HF tokenizers need the tokenizers package: "
                          f"pip install 'rlfusion[{EXTRA}]'") from None

    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # the Rust library raises a bare Exception for every parse error
        raise ValueError(f"{where}: not a valid HF tokenizer ({first_line(e)})") from None


def tokenizer_from_dict(d: dict, where: str = "tokenizer dict"):
    """The tokenizer of a checkpoint's JSON form: `CharTokenizer` (`kind="char"`) or HF.
    `where` (the checkpoint's `config.json`) is named by every error."""
    from rlfusion.model.tokenizer import CharTokenizer

    if not isinstance(d, dict):
        raise ValueError(f"{where}: 'tokenizer' must be a JSON object, got {type(d).__name__}")
    if d.get("kind") == "hf":
        return HFTokenizer.from_dict(d, where)
    if d.get("kind") != "char":
        raise ValueError(f"{where}: tokenizer kind={d.get('kind')!r} is unknown; allowed: char, hf")
    try:
        return CharTokenizer.from_dict(d)
    except ValueError as e:  # CharTokenizer knows nothing of files
        raise ValueError(f"{where}: {e}") from None
