"""Host-side integer helpers for the kernel wrappers, which run once per layer per step.

triton.next_power_of_2 and triton.cdiv are ConstexprFunction objects in Triton 3.6 and cost some
5 microseconds per call from Python; a prefill step makes hundreds of such calls."""


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
