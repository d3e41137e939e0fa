"""The command line.

    python superinfer.py "Why is the sky blue?"      a reply from the embedded model
    python superinfer.py serve --port 8000           the OpenAI-compatible server (server.py)

Arguments are checked before anything loads; a mistake is one line of text, not a traceback.
"""
from __future__ import annotations

import sys

import server
from flags import Parser, add_engine_flags, engine_config
from loader import resolve_device
from model import ModelLoadError
from superinfer import LLM, SamplingParams


def generate_parser() -> Parser:
    ap = Parser(prog="superinfer", description="Generate a reply with SuperInfer. "
                "`superinfer serve --help` for the server.")
    ap.add_argument("prompt", help="the user message")
    ap.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (128)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--request-seed", type=int, default=None, help="seed of this request")
    ap.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the "
                    "chat template")
    add_engine_flags(ap)
    return ap


def generate(argv: list[str]) -> None:
    ap = generate_parser()
    args = ap.parse_args(argv)
    cfg = engine_config(ap, args)
    try:
        resolve_device(cfg.device)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.request_seed)
    except ValueError as e:
        ap.error(str(e))
    try:
        llm = LLM(**vars(cfg))
    except (ModelLoadError, ValueError) as e:
        sys.exit(f"superinfer: error: {e}")
    prompt = args.prompt if args.no_chat else llm.chat_prompt(args.prompt)
    out = llm.generate([prompt], params)[0]
    llm.close()
    if out.error:
        sys.exit(f"superinfer: error: {out.error}")
    print(out.text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        server.main(argv[1:])
    else:
        generate(argv)


if __name__ == "__main__":
    main()
