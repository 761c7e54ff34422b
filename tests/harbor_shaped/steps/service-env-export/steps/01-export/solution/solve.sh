#!/bin/bash
cd /app && python3 - <<'PY'
import configparser

ini = configparser.ConfigParser()
ini.read("service.ini")
with open("service.env", "w") as out:
    for section in ini.sections():
        for key, value in ini[section].items():
            out.write(f"{section.upper()}_{key.upper()}={value}\n")
PY
