"""Problems (prompt + reference answer) and the batched stream the training loop draws from."""

from dsv4rl.data.arith import ArithProblems
from dsv4rl.data.datasets import DATASETS, DatasetError, load_file_problems, load_problems, problem_source
from dsv4rl.data.problems import Problem
from dsv4rl.data.stream import PromptStream, build_prompt_stream

__all__ = [
    "DATASETS",
    "ArithProblems",
    "DatasetError",
    "Problem",
    "PromptStream",
    "build_prompt_stream",
    "load_file_problems",
    "load_problems",
    "problem_source",
]
