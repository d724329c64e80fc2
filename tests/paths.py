"""Where the tests find the repository, their own support files and the shared trace (tests sit one
folder down, by the package they test, so ``__file__`` arithmetic is kept here, once)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
README = ROOT / "README.md"
# Mooncake's conversation trace, read where it lies beside the checkout (never copied in)
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
