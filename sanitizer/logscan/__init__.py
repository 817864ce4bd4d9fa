"""`hazsan logscan`: the corruption signature in SGLang and vLLM server logs (docs/cli.md,
"hazsan logscan"; docs/logscan-formats.md)."""
from sanitizer.logscan.parse import BrokenLine, DecodeLine, parse_line
from sanitizer.logscan.scan import Interval, LogError, LogScanner, ScanResult, VllmRecord, scan
from sanitizer.logscan.vllm import VllmSpec, VllmStats, parse_vllm_line

__all__ = ["BrokenLine", "DecodeLine", "Interval", "LogError", "LogScanner", "ScanResult", "VllmRecord", "VllmSpec",
           "VllmStats", "parse_line", "parse_vllm_line", "scan"]
