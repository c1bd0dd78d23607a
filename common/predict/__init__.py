"""The models: predictions as functions of a run's setup and a calibration, outside the training run.

    memory.py       predicted bytes per rank by component, for every strategy
    volume.py       the bytes each strategy is expected to send per optimizer step
    timemodel.py    the step model: data, compute, exposed communication and optimizer time of a step
    calibration.py  the step model's measured inputs for one machine (benchmark.py calibrate writes them)
    timespec.py     the step model's inputs for hardware the user does not have (datasheets, interconnects)
    datasheet.py    a GPU's HBM bandwidth, SMs, clock and host link (beside common/measure/flops.py's peaks)
    roofline.py     GPU compute per op from the datasheet, at rates measured on the project's H100 rows
    links.py        NCCL's collectives per named interconnect (published nccl-tests figures)
    whatif.py       the what-if check table (whatif_checks.json): advise --gpu beside measured, published figures
    timepred.py     a row's pred_* time columns from its setup and a calibration
    stats.py        median, spread and bootstrap intervals over repeated launches

Nothing here is imported by the training loop's instruments (common/measure/): they measure, these predict.
"""
