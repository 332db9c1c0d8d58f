"""The pinned source: the pin, the sdist, the patch series, prepared trees and offline archives."""
