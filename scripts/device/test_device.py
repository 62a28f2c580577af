"""Unit tests of the device-check summary's parsers on recorded tool output shapes
(run by tests/device_check.rs: `python3 -m unittest discover -s scripts/device`)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import peers  # noqa: E402
import summary  # noqa: E402

NCU_CSV = """==PROF== Connected to process 4242 (/root/out/device/sparsekit)
==PROF== Profiling "topk" - 0: 0%....50%....100% - 9 passes
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","sparsekit","127.0.0.1","topk","1","14","(1024, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum.per_second","Tbyte/s","1.21"
"0","4242","sparsekit","127.0.0.1","topk","1","14","(1024, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum.per_second","Gbyte/s","4.50"
"0","4242","sparsekit","127.0.0.1","topk","1","14","(1024, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","1,234.50"
"0","4242","sparsekit","127.0.0.1","topk","1","14","(1024, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","sm__warps_active.avg.pct_of_peak_sustained_active","%","41.7"
"""


class Parsers(unittest.TestCase):
    def test_ncu_csv(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "ncu.csv"), "w") as f:
                f.write(NCU_CSV)
            got = summary.ncu(d)
        self.assertEqual(set(got), {"topk"})
        self.assertAlmostEqual(got["topk"]["gpu__time_duration.sum"]["value"], 1234.5)
        self.assertEqual(got["topk"]["dram__bytes_read.sum.per_second"]["unit"], "Tbyte/s")
        self.assertAlmostEqual(got["topk"]["sm__warps_active.avg.pct_of_peak_sustained_active"]["value"], 41.7)

    def test_sanitizer_summaries(self):
        with tempfile.TemporaryDirectory() as d:
            cases = {
                "memcheck": ("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 3 errors\n", 3),
                "racecheck": ("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n", 1),
                "synccheck": ("========= ERROR SUMMARY: 0 errors\n", 0),
                "initcheck": ("killed before it printed a summary\n", None),
            }
            for tool, (text, _) in cases.items():
                with open(os.path.join(d, f"sanitize_{tool}.err"), "w") as f:
                    f.write(text)
            for tool, (_, want) in cases.items():
                self.assertEqual(summary.sanitizer(d, tool), want, tool)

    def test_bench_ids_parse_to_shapes(self):
        bench = {"results": [
            {"op": "indexer_logits", "config": "bf16/b8_ctx65536_h64_n1"},
            {"op": "topk", "config": "rows64_ctx65536_k2048"},
            {"op": "sparse_mla", "config": "fp8_ds_mla/t8_h64_topk2048"},
            {"op": "kv_store", "config": "bf16/t8192"},
            {"op": "topk", "config": "unparseable"},
        ]}
        rows = peers.parse_rows(bench)
        self.assertEqual([r[0] for r in rows], ["indexer_logits", "topk", "sparse_mla"])
        self.assertEqual(rows[0][2], {"dtype": "bf16", "b": 8, "ctx": 65536, "h": 64, "n": 1})
        self.assertEqual(rows[1][2], {"rows": 64, "ctx": 65536, "k": 2048})
        self.assertEqual(rows[2][2]["k"], 2048)

    def test_failed_validation_record_fails_the_summary(self):
        with tempfile.TemporaryDirectory() as raw, tempfile.TemporaryDirectory() as out:
            with open(os.path.join(raw, "steps.tsv"), "w") as f:
                f.write("validate_quick\tpass\t3\texit 0\n")
            with open(os.path.join(raw, "validate_quick.json"), "w") as f:
                json.dump([{"op": "topk", "status": "pass", "worst_ratio": 0.0},
                           {"op": "topk", "status": "fail", "worst_ratio": 7.5}], f)
            r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "summary.py"),
                                "--raw", raw, "--out", out], capture_output=True, text=True)
            self.assertEqual(r.returncode, 1, r.stderr)
            s = json.load(open(os.path.join(out, "summary.json")))
            self.assertFalse(s["ok"])
            self.assertEqual(s["validate"]["quick"]["topk"], {"pass": 1, "fail": 1, "worst_err_over_tol": 7.5})


if __name__ == "__main__":
    unittest.main()
