import os
import sys

# Tests import the packages from the checkout even when it is not pip-installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
