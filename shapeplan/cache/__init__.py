"""`shapeplan cache`: export a warmed compile cache as a portable archive, import it on another machine (archive.py)."""
