"""The tokenizer this instance serves its model with, as it publishes it to gateways.

The connector publishes what a gateway needs to compute the prompt token ids this engine
computes (`pdplane.core.tokenizer`): the files of the tokenizer vLLM loaded
(`model_config.tokenizer`, a local folder or the Hugging Face cache vLLM downloaded it to; never
a download of its own), the chat template the API server renders chats with when
`--chat-template` overrides the tokenizer's, and `--default-chat-template-kwargs`. Those two
options belong to the API server, not to the engine's config: they are read from the server's
command line (the engine process inherits it) with vLLM's own argument parser, so a YAML
`--config` and every spelling vLLM accepts read as vLLM reads them. What this cannot see (a
template from a multimodal processor, vLLM's fallback templates) the gateway catches by checking
the published tokenizer against this instance's `/tokenize` before it routes by it.

Nothing is published, and the reason is logged and served, for `--skip-tokenizer-init`, a
tokenizer mode other than auto/hf/slow (e.g. mistral), or a tokenizer that needs
`trust_remote_code`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

from pdplane.core.tokenizer.bundle import TokenizerUnpublishable, collect
from pdplane.core.tokenizer.servicer import Published

__all__ = ["published_tokenizer", "server_chat_options"]

log = logging.getLogger(__name__)


def _server_args(argv: list[str]) -> list[str]:
    """The API server's arguments in `argv`: after `serve` for `vllm serve` (its positional
    model as `--model`), else all."""
    if len(argv) > 1 and argv[1] == "serve":
        args = argv[2:]
        if args and not args[0].startswith("-"):
            args = ["--model", *args]
        return args
    return argv[1:]


def server_chat_options(argv: list[str] | None = None) -> tuple[str, str]:
    """(chat template text, default chat template kwargs as JSON) that the API server started
    with `argv` (default `sys.argv`) renders chats with; ("", "") when it overrides neither or
    its command line cannot be read (the gateway's `/tokenize` check then decides)."""
    args = _server_args(list(sys.argv if argv is None else argv))
    if not any(
        a.startswith(("--chat-template", "--chat_template", "--default-chat", "--config"))
        for a in args
    ):
        return "", ""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        try:  # vLLM >= 0.32
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
        except ImportError:  # vLLM 0.26 .. 0.31
            from vllm.entrypoints.openai.cli_args import (  # type: ignore[import-not-found,no-redef]
                make_arg_parser,
            )
        parser = make_arg_parser(FlexibleArgumentParser())
        try:
            # parse_args: vLLM's own spellings (`--chat_template`, `--config` YAML) apply. Its
            # usage message on a refusal is not for this process's log.
            with contextlib.redirect_stderr(io.StringIO()):
                parsed = parser.parse_args(args)
        except SystemExit:  # a flag this vLLM's parser lacks: the known ones still count
            parsed, _ = parser.parse_known_args(args)
    except (Exception, SystemExit) as exc:  # argparse exits on what it cannot parse
        log.warning("cannot read the server's chat options from its command line: %s", exc)
        return "", ""
    template = _template_text(getattr(parsed, "chat_template", None))
    kwargs = getattr(parsed, "default_chat_template_kwargs", None)
    return template, json.dumps(kwargs, sort_keys=True) if kwargs else ""


def _template_text(value: str | None) -> str:
    """The Jinja text of `--chat-template` (a file path or the template itself), as vLLM's
    `load_chat_template` reads it."""
    if not value:
        return ""
    try:
        try:  # vLLM >= 0.32
            from vllm.renderers.chat_utils import load_chat_template
        except ImportError:  # older vLLM
            from vllm.entrypoints.chat_utils import (  # type: ignore[no-redef]
                load_chat_template,
            )
        return str(load_chat_template(value) or "")
    except Exception as exc:  # vLLM refuses it too: the server did not start with it
        log.warning("cannot read --chat-template %r: %s", value[:80], exc)
        return ""


def _tokenizer_dir(name: str, revision: str | None) -> Path:
    """The local folder of tokenizer `name`: itself, or its snapshot in the Hugging Face cache
    (where vLLM downloaded it; nothing is fetched here). Raises TokenizerUnpublishable."""
    if Path(name).is_dir():
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception as exc:  # not cached, or not a repository name
        raise TokenizerUnpublishable(
            f"tokenizer {name!r} is not a local folder nor in the Hugging Face cache ({exc})"
        ) from None


def published_tokenizer(vllm_config: Any) -> Published:
    """What this instance publishes: the bundle of its tokenizer, or why there is none (also
    logged). Never raises."""
    model = vllm_config.model_config
    try:
        if getattr(model, "skip_tokenizer_init", False):
            raise TokenizerUnpublishable("vLLM runs with --skip-tokenizer-init")
        directory = _tokenizer_dir(
            str(getattr(model, "tokenizer", None) or model.model),
            getattr(model, "tokenizer_revision", None),
        )
        template, kwargs = server_chat_options()
        mode = str(getattr(model, "tokenizer_mode", "auto") or "auto")
        return collect(
            directory,
            chat_template=template,
            default_chat_template_kwargs=kwargs,
            tokenizer_mode=mode,
        )
    except TokenizerUnpublishable as exc:
        log.warning("tokenizer not published (gateways route this model by load): %s", exc)
        return str(exc)
    except Exception as exc:  # a bug here must not take the engine down
        log.exception("tokenizer not published")
        return f"internal error: {type(exc).__name__}"
