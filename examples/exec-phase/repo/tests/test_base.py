import unittest

import textkit


class PackageTest(unittest.TestCase):
    def test_package_imports(self):
        self.assertTrue(textkit.__doc__)
