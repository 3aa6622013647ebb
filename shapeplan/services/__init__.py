"""The services the command line presents: analyze, advise, doctor, loading a run, the reports, the trainers."""
