"""tools/ncu_profile.py: the summary parses Nsight Compute's CSV pages (no GPU or ncu needed)."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("ncu_profile", Path(__file__).resolve().parents[1] / "tools" / "ncu_profile.py")
ncu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu)

DETAILS = '''==PROF== Connected to process 123
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","123","python3","h","w4_gemm_kernel","1","7","(128, 1, 1)","(448, 1, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","81.52"
"0","123","python3","h","w4_gemm_kernel","1","7","(128, 1, 1)","(448, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","us","41.06"
"0","123","python3","h","w4_gemm_kernel","1","7","(128, 1, 1)","(448, 1, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","168"
"0","123","python3","h","w4_gemm_kernel","1","7","(128, 1, 1)","(448, 1, 1)","0","9.0","Other","Not Kept","x","1"
'''
RAW = '''"ID","Kernel Name","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"
"","","ratio","ratio","ratio"
"0","w4_gemm_kernel","3.50","0.75","1,204.00"
'''


def test_parse_details_keeps_the_named_metrics():
    m = ncu.parse_details(DETAILS)
    assert m == {"DRAM Throughput": "81.52 %", "Duration": "41.06 us", "Registers Per Thread": "168 register/thread"}
    assert ncu.parse_details("==PROF== nothing profiled\n") == {}


def test_parse_stalls_ranks_reasons():
    assert ncu.parse_stalls(RAW, top=2) == "barrier 1204.00, long_scoreboard 3.50"
    assert ncu.parse_stalls("") == "-"


def test_default_cases_are_well_formed():
    for case in ncu.DEFAULT_CASES:
        kind = case.split(":")[0]
        assert kind in ncu.KERNEL, case
