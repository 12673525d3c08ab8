/** This client's version; the repository's VERSION file holds it for every package (tests/unit/test_versions.py keeps them equal). */
export const VERSION = "0.1.0";
