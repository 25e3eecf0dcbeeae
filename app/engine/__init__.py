"""The episode engine: the loop, rehearsal modes, selectors, and episode summaries."""
from app.engine.report import compute_time, end_reason_text, episode_json, format_step
from app.engine.runner import EpisodeRunner

__all__ = ["EpisodeRunner", "compute_time", "end_reason_text", "episode_json", "format_step"]
