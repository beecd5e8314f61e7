"""Built-in environments: no download, sized for a small (135M) instruct model.

Each class has ``default_prompts()`` / ``default_eval_prompts()`` (class methods giving prompt
records: ``{"prompt": str, <the fields reset takes>}``) and ``default_reward`` (``None`` when the
environment pays itself, else the name of the built-in reward that scores its transcripts).
"""

from .arithmetic_retry import ArithmeticRetry
from .calculator import Calculator, calculator_prompts, evaluate_expression
from .guess_number import GuessNumber

__all__ = ["ArithmeticRetry", "Calculator", "GuessNumber", "calculator_prompts", "evaluate_expression"]
