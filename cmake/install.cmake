# What `cmake --install` and `pip install` put where.
#
# cmake --install BUILD --prefix P: P/include/mok (the public headers), P/lib/libmok.so (the
# C and C++ API; a link to libmok.so.MAJOR.MINOR, its SONAME, and that to the full version's
# file), P/bin/mok (the CLI) and P/lib/cmake/mok (a CMake package: find_package(mok) gives the
# target mok::mok). tests/install_consumer builds a program against it.
#
# pip install . (pyproject.toml, scikit-build-core sets SKBUILD): the Python package `mok`
# with libmok.so inside it, and the mok command among the environment's scripts.
if(SKBUILD)
  install(TARGETS mok_shared LIBRARY DESTINATION mok)
  install(TARGETS mok_cli RUNTIME DESTINATION ${SKBUILD_SCRIPTS_DIR})
  return()
endif()

include(CMakePackageConfigHelpers)
install(TARGETS mok_shared EXPORT mokTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS mok_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/mok DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
set(MOK_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/mok)
install(EXPORT mokTargets NAMESPACE mok:: DESTINATION ${MOK_CMAKE_DIR})
configure_package_config_file(cmake/mokConfig.cmake.in ${CMAKE_BINARY_DIR}/mokConfig.cmake
                              INSTALL_DESTINATION ${MOK_CMAKE_DIR})
# 0.x: a minor version may change the API (and the C ABI, which mok_c_abi_version() tells).
write_basic_package_version_file(${CMAKE_BINARY_DIR}/mokConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/mokConfig.cmake ${CMAKE_BINARY_DIR}/mokConfigVersion.cmake
        DESTINATION ${MOK_CMAKE_DIR})
