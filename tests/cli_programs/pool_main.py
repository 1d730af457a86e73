"""Use a ``spawn`` pool of functions defined in this ``__main__``, as DataLoader workers do."""

import multiprocessing
import os


def square(value: int) -> int:
    return value * value


if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        print(os.environ["RANK"], sum(pool.map(square, range(10))), flush=True)
