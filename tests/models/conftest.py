"""The model folders shipped in the repository (models/), as the tests here see them."""

from __future__ import annotations

from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "models"
SMALL = MODELS / "pycode-small"
DRAFT = MODELS / "pycode-draft"

CODE_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for i, line in enumerate(lines):\n        if not line.strip():\n",
]
