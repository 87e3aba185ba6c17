"""Whether a pytest JUnit XML file shows any test case that ran and passed (gpu_lease.sh).

    python bench/lease_junit.py FILE.xml   # exit 0: at least one passed; 1: none (all skipped,
                                           # none collected, or no readable file)

In GPU mode the CUDA tests skip themselves when dspark_rt._C has no CUDA kernels, and pytest
then exits 0: the lease counts such a run as a failure.
"""
import sys
import xml.etree.ElementTree as ET


def passed(path) -> int:
    try:
        cases = list(ET.parse(path).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        return 0
    return sum(not any(c.find(t) is not None for t in ("skipped", "failure", "error")) for c in cases)


if __name__ == "__main__":
    n = passed(sys.argv[1])
    print(f"lease_junit: {n} test cases passed in {sys.argv[1]}")
    sys.exit(0 if n else 1)
