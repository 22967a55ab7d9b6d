"""Constrained decoding: a request's output held to a JSON schema, any JSON object, a regex, a
choice list or an EBNF grammar.

spec.StructuredOutput is what a request asks for (SamplingParams.structured_output), checked by
checks.py (size limits; what xgrammar would not enforce); grammar.py compiles it with xgrammar, on
compile_jobs.py's bounded threads, and keeps one matcher per request; step_masks.py fills a step's
token bitmask on the host for the rows that are constrained. The sampler applies that bitmask.
"""
from asyncllm.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
