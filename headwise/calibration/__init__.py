from headwise.calibration.calibrate import calibrate, select_from_scores

__all__ = ["calibrate", "select_from_scores"]
