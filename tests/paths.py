"""Where the tests find the repository and their own support files (tests sit one folder down, by the
package they test, so ``__file__`` arithmetic is kept here, once). Nothing outside the repository:
a test makes the data it needs."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
README = ROOT / "README.md"
