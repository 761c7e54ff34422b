#!/bin/bash
# The overrides arrive read-only, as a deployment would hand them over.
set -e
mv overrides.ini.in overrides.ini
chmod 0444 overrides.ini
