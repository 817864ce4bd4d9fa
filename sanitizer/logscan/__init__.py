"""`hazsan logscan`: the corruption signature in SGLang server logs (docs/cli.md, "hazsan logscan")."""
from sanitizer.logscan.parse import BrokenLine, DecodeLine, parse_line
from sanitizer.logscan.scan import LogError, LogScanner, ScanResult, scan

__all__ = ["BrokenLine", "DecodeLine", "LogError", "LogScanner", "ScanResult", "parse_line", "scan"]
