from headwise.calibration.calibrate import calibrate

__all__ = ["calibrate"]
