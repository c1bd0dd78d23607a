#!/bin/bash
# every 5 s: epoch and /proc/stat cpu line, and vda's read sectors
while true; do echo "$(date +%s) $(head -1 /proc/stat) $(awk '$3=="vda"{print $6, $7}' /proc/diskstats)"; sleep 5; done
