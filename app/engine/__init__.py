"""The episode engine: the loop, rehearsal modes, selectors, and episode summaries."""
from app.engine.report import episode_json, format_step
from app.engine.runner import EpisodeRunner

__all__ = ["EpisodeRunner", "episode_json", "format_step"]
