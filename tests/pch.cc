// tests/pch.cc — the translation unit that builds the tests' shared precompiled header
// (tests/CMakeLists.txt, lockstep_test_pch).
